"""What a machine is: system specs (data files with sources), node fabrics, dragonfly graphs,
routing and rank placement."""
