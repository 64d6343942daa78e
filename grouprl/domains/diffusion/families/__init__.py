"""Flow model families beyond SD3: each a ``FlowModel`` subclass and loader, registered in ``models.FLOW_FAMILIES``."""
