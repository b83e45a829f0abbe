"""Layout maps that split a backbone over a device mesh."""


def backbone_layout_map(backbone, device_mesh, layout="expert", batch_size=None):
    """Layout map of `backbone` (see `VisionTransformerBackbone.get_layout_map`)."""
    from keras_vmoe import distribution

    distribution.check_divisible(
        dict(zip(device_mesh.axis_names, device_mesh.shape, strict=True)),
        layout,
        config=backbone.get_config(),
        batch_size=batch_size,
    )
    return distribution.layout_map(device_mesh, layout)
