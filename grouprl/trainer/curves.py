"""Moved to :mod:`grouprl.domains.demos.curves` (what the demos share); this path works for one release."""
from grouprl.moved import alias_package

alias_package(__name__, "grouprl.domains.demos.curves")
