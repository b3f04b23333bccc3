"""Rules shared by the node agent and the operator, so that neither imports the other."""
