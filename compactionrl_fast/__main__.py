"""`python -m compactionrl_fast {demo,train,plot,bench}`."""
from .cli import main

raise SystemExit(main())
