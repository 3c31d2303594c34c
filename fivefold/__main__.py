from fivefold.cli import main

raise SystemExit(main())
