"""Flow model families beyond SD3: each module holds one family's FlowModel, its conditioning, loader and tiny stand-in."""
