"""The lorafleet Kubernetes operator (kopf): LoraAdapter and LoraFleet reconciliation."""
