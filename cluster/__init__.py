"""Ray wiring: placement, the driver that runs the sync schedule, and the `staleflow` CLI."""
