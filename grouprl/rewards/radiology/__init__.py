"""Moved to ``grouprl.domains.radiology.rewards``; this path (and every module under it) works until the next release."""
from grouprl.moved import alias_package

alias_package(__name__, "grouprl.domains.radiology.rewards")
