"""The web console (`kubectl tether ui`, or /console behind the gateway): runs, attempt timelines,
budgets and the review queue, acting with the user's own Kubernetes credentials only."""
