"""Train-time reading of a build: prepare (open or build the data), mixing, packing and the batch loader."""
