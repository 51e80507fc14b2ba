.PHONY: image-update

# build the bundles, then build and register a new default golden image ($$ABOX_HOME/images)
image-update:
	npm run build && node dist/abox.js image build
