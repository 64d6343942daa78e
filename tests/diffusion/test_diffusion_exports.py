"""grouprl.domains.diffusion exports its public names at its top, each imported on first use."""


def test_exported_names_resolve_and_load_on_first_use(check_lazy_exports):
    check_lazy_exports("grouprl.domains.diffusion")
