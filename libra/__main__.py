from libra.cli import main

raise SystemExit(main())
