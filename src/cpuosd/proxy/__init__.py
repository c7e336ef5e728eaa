"""The preview proxy: live URLs for servers inside sandboxes."""
