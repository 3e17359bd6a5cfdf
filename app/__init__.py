"""Flashgate operator console: profiles, engine control, telemetry, qualification, promotion, the agent route.

It never imports `engine` or torch: the two planes meet over HTTP and the engine's command line.
"""
