"""Hypothesis settings for the suite: no deadlines (worker processes start at their own pace)."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("default")
