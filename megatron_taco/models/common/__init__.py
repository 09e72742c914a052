"""Model pieces shared by TACO and SAS: norms and init, the parallel MLP, the tied LM-head
transform, and the relative-position machinery (c2p/p2c products)."""
