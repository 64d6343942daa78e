"""The diffusion domain's parts, registered by name (the ``diffusion`` entry point of ``grouprl.plugins``).

Registered lazily: naming a part imports its module, so loading the plugin imports
neither diffusers nor the image rewards.
"""
