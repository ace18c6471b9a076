import os

import torch
from hypothesis import HealthCheck, settings

# Stated once: property tests run many small models; shrinking and timing noise on a shared 2-core machine must not
# fail them, and CI runs a fixed, derandomised set so a red run is reproducible.
settings.register_profile(
    "dev", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(min(2, torch.get_num_threads()))
