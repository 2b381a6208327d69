"""What every run stands on: the run directory, checkpoints, backends, launch, trackers, schedules,
throughput, files and errors."""
