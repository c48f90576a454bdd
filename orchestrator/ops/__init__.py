"""Running orchestrator as an operator does: the pre-flight checks of ``doctor``, the
systemd units of ``deploy systemd``, and the worker's side of systemd (sd_notify and the
watchdog)."""
