"""What the test tiers share: references, launches, the process pool, fault hooks,
workers and stand-ins."""
