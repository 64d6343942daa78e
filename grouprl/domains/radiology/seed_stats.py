"""Moved to :mod:`grouprl.domains.demos.seed_stats` (every demo's seed statistics); this path works for one release."""

from grouprl.moved import alias_package

alias_package(__name__, "grouprl.domains.demos.seed_stats")
