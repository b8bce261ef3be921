"""Virtual-time fleet simulation: the gateway's real policies in front of simulated SGLang workers."""
