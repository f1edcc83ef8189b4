"""An example project for ampsweep: its own model and data set, trained and swept by ampsweep
from this folder's conf/ without touching ampsweep itself (see the README section "Your own
model, data and loss")."""
