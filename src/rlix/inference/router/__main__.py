"""`python -m rlix.inference.router`: a router as its own process."""

from rlix.inference.router.app import main

main()
