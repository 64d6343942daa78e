"""Flow model families beyond SD3, one module each (registered in ``grouprl.domains.diffusion.models.FLOW_FAMILIES``)."""
