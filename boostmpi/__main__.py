from boostmpi.cli import main

raise SystemExit(main())
