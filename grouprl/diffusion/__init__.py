"""Moved to ``grouprl.domains.diffusion`` (``sampling`` is now ``scheduler``); this path works until the next release."""
from grouprl.moved import alias_package

alias_package(__name__, "grouprl.domains.diffusion", renamed={"sampling": "scheduler"})
