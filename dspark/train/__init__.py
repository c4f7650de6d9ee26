"""Drafter training and calibration."""
