"""Backend implementations of the ``fusedres`` ops. Each module defines ``unavailable_reason``
and the ops of :data:`fusedres.ops.opdefs.SCHEMAS` under their names (``batch_stats``,
``bn_relu_conv2d``, ``bn_relu_conv2d_genstats``, ``bn_relu_conv2d_backward``), taking the
schema's arguments in order."""
