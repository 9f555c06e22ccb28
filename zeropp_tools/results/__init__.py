"""``make results``: every figure the README and docs/results state, measured at one clean
commit (:mod:`.tiers`, :mod:`.runner`) and written into those files from the stored JSON
(:mod:`.render`)."""
