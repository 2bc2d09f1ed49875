"""Promotions: the champion (and following the registry), version directories, the registration queue."""
