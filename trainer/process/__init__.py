"""The trainer as a process: settings (one type, defaults written once), the builder, the leader lease."""
