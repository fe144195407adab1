"""Training of the shipped character models: the speech corpus made offline, the codec and the DiT
(`python -m training.train corpus|codec|dit|all`)."""
