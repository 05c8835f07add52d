"""The operators' controls: holds on disk, the reasons to pause, the active hours."""
