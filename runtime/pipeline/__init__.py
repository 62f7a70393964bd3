"""Pipeline-parallel runtime: per-stage programs, point-to-point transfers, the schedule interpreter."""
