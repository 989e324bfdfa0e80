"""Device backends of OVQ-attention (chosen in :mod:`mixerzoo_ovq.layer` by device)."""
