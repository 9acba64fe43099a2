"""Tiers: the G2 policy and the G3 storage tiers (SecondaryTierManagers)."""
