"""Quality yardsticks: the held-out corpus split and bits/byte through ouro's engine."""
