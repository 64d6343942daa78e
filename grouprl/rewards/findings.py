"""Moved to ``grouprl.domains.radiology.findings``; this path works until the next release."""
from grouprl.moved import alias_package

alias_package(__name__, "grouprl.domains.radiology.findings")
