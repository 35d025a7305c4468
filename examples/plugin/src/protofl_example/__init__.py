"""An example protofl plugin: FedAvgM, a residual MLP, the wine data and shard partitions."""
