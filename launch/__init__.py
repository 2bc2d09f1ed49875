"""Starting, health-checking and stopping child processes: what `adaptive-spec up`, the benchmarks
that start servers and trainers, and the test harnesses share.

- processes.py: a child command with its log file, waited on until it is healthy, stopped by its pid;
- redis.py: a redis-server on loopback (a free port), started and stopped by its pid.
"""
