"""What steers the filler from outside, read from files, signals and the clock: the operators' controls (the pause
switch and file, the active hours) and the holds (on disk, the kubelet's, the Docker watch's). control/reasons.py
ranks what they say."""
