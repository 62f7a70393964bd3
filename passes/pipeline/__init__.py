"""Pipeline parallelism as data: schedules (``Action`` lists), their simulator, and stage plans."""
