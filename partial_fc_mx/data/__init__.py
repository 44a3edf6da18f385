"""Face datasets: RecordIO reading and packing, loaders, ORL faces, synthetic identities."""
