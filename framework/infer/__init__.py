"""Using a trained model: sampling text (`tessera generate`) and log-likelihood scoring of tasks."""
