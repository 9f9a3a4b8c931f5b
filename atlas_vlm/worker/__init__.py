"""The worker side of a step: input preparation (pure), the ``ModelRunner`` and the sampler."""
