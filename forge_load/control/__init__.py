"""The control loop and its pure parts: the probe's protocol, the foreign-job detectors, the Monitor, the policy,
the controller, the power cap, the Worker and the Filler that drives them. No GPU library is imported here."""
