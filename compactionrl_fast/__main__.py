"""`python -m compactionrl_fast {demo,train,plot,bench}`."""
from .app.cli import main

raise SystemExit(main())
