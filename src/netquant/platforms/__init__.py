"""netquant.platforms"""
