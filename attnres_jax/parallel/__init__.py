"""Pipeline parallelism over a 'stage' mesh axis."""
