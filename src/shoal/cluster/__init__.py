"""shoal on a cluster: a torch-free gateway, a NATS JetStream work queue, workers that pull (DESIGN §5)."""
