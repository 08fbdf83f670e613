"""A shared rlix cluster: its head process, job registry, admission and the commands around them."""
