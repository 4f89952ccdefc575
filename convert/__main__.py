from .published import main

raise SystemExit(main())
